"""``ejkernel bench``: a CPU run at tiny shapes (XLA implementation, one peer), the results schema, the report
and plots, and BENCHMARKS.md's generated sections against their results files (a hand edit fails here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ejkernel.bench import report, schema
from ejkernel.bench.cases import CASES
from ejkernel.bench.run import run
from ejkernel.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("ejkernel_xla", reason="the run tests time ejkernel-xla's implementation")


def test_benchmarks_md_matches_its_results_files() -> None:
    docs = schema.load([ROOT / "benchmarks" / "results"])
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "<!-- bench:begin" in text
    assert report.update(text, docs) == text, (
        "BENCHMARKS.md's generated sections differ from benchmarks/results: run "
        "`ejkernel bench --report benchmarks/results --update BENCHMARKS.md`"
    )


def test_update_rewrites_only_the_sections() -> None:
    docs = schema.load([ROOT / "benchmarks" / "results"])
    name = sorted(docs)[0]
    text = f"prose before\n<!-- bench:begin {name} -->\nstale\n<!-- bench:end {name} -->\nprose after\n"
    out = report.update(text, docs)
    assert out.startswith("prose before\n") and out.endswith("prose after\n") and "stale" not in out
    with pytest.raises(KeyError, match="no results file"):
        report.update("<!-- bench:begin nope -->\n<!-- bench:end nope -->", docs)


def test_run_on_cpu_writes_a_valid_results_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    shapes = [CASES["flash_attention"].parse(s) for s in ("B=1,H=2,T=32,D=16", "B=1,H=2,T=64,D=16,causal=1")]
    doc, path = run(
        "flash_attention",
        shapes,
        impls=["xla"],
        peers=["jax-xla"],
        dtype="float32",
        passes=("fwd", "fwd_bwd"),
        out_dir=tmp_path,
        budget_s=0.01,
        progress=False,
    )
    assert path is not None and path.exists()
    on_disk = json.loads(path.read_text())
    schema.validate(on_disk)
    records = on_disk["records"]
    assert len(records) == 2 * 2 * 2
    assert {(r["impl"], r["kind"]) for r in records} == {("xla", "implementation"), ("jax-xla", "peer")}
    for r in records:
        assert r["status"] == "ok", r
        assert r["error"] < 1e-4 and r["value"] > 0 and r["seconds"] > 0
        assert r["metric"] == "TFLOP/s" and "4·B·H·T·S·D" in r["model"]
        assert r["device"] and r["fingerprint"] and r["commit"] and r["date"] and r["command"]
    md = report.table(records)
    assert "| B1 H2 T32 D16 | float32 | fwd |" in md and "jax-xla †" in md
    pngs = report.plots({path.stem: on_disk}, tmp_path / "plots")
    assert pngs and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_a_wrong_result_fails_and_is_not_timed(tmp_path: Path) -> None:
    from ejkernel.bench import peers

    wrong = peers.Peer("wrong", "flash_attention", lambda s, i: lambda q, k, v: q * 2)
    peers.register(wrong)
    try:
        doc, _ = run(
            "flash_attention",
            [CASES["flash_attention"].parse("B=1,H=1,T=16,D=8")],
            impls=[],
            peers=["wrong"],
            dtype="float32",
            progress=False,
        )
    finally:
        del peers.PEERS[("flash_attention", "wrong")]
    (r,) = doc["records"]
    assert r["status"] == "failed" and "wrong result" in r["reason"] and "value" not in r and r["error"] > 0.1


@pytest.mark.parametrize("gates", ["gv=1", "gk=1,gv=1"])  # gv alone: g_k is a None placeholder
def test_recurrent_key_and_value_gates_are_timed_and_checked(gates: str) -> None:
    shape = CASES["recurrent"].parse(f"B=1,T=20,H=2,K=8,V=4,{gates}")
    inputs = CASES["recurrent"].make(shape, "float32")
    assert [a is None for a in inputs.args[4:]] == [not shape["gk"], not shape["gv"]]
    assert inputs.diff == tuple(i for i, a in enumerate(inputs.args) if a is not None)
    doc, _ = run(
        "recurrent", [shape], impls=["xla"], peers=[], dtype="float32", passes=("fwd", "fwd_bwd"), progress=False
    )
    assert len(doc["records"]) == 2
    for r in doc["records"]:
        assert r["status"] == "ok" and r["error"] < 1e-4, r
    assert all(name in report.table(doc["records"]) for name, on in shape.items() if on is True)


def test_schema_rejects_a_bad_record() -> None:
    with pytest.raises(schema.SchemaError, match="positive value"):
        schema.validate(
            {
                "schema": schema.SCHEMA,
                "run": {},
                "records": [
                    {
                        k: "x"
                        for k in (
                            "op",
                            "impl",
                            "dtype",
                            "metric",
                            "model",
                            "date",
                            "device",
                            "fingerprint",
                            "commit",
                            "command",
                        )
                    }
                    | {"kind": "peer", "shape": {}, "pass": "fwd", "status": "ok"}
                ],
            }
        )


def test_cli_json_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "flash_attention",
        "--shapes",
        "1x1x16x8",
        "--impls",
        "xla",
        "--peers",
        "none",
        "--dtype",
        "float32",
        "--budget-s",
        "0.01",
        "--json",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["impl"] for r in records] == ["xla"] and records[0]["status"] == "ok"
    assert main(["bench", "--report", str(tmp_path), "--out", str(tmp_path / "r.md")]) == 0
    assert "| B1 H1 T16 D8 | float32 | fwd |" in (tmp_path / "r.md").read_text()
    assert main(["bench", "--presets"]) == 0 and "flash-h200" in capsys.readouterr().out
    assert main(["bench", "no_such_op"]) == 2


@pytest.mark.parametrize("zipf", [False, True])
def test_grouped_matmul_check_by_group_matches_the_plain_reference(monkeypatch: pytest.MonkeyPatch, zipf: bool) -> None:
    # Past PLAIN_GROUPED_MAX the bench checks grouped_matmul group by group (the plain reference's [G, M, N] needed
    # 64 GiB at the DeepSeek-V3 shape) tile by tile; both forms agree, value and gradients, empty groups included.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ejkernel.bench import cases

    case = CASES["grouped_matmul"]
    inputs = case.make({"G": 6, "M": 70, "K": 16, "N": 12, "zipf": zipf}, jnp.float32)
    lhs, rhs, sizes = inputs.args
    sizes = sizes.at[0].add(-3) if not zipf else sizes  # balanced: rows past every group too
    inputs = cases.Inputs((lhs, rhs, sizes), inputs.kwargs, inputs.diff)

    def loss(ref, lhs, rhs):
        return jnp.sum(ref(cases.Inputs((lhs, rhs, sizes), {}, (0, 1)), inputs) ** 2)

    plain = jax.value_and_grad(loss, argnums=(1, 2))(case.reference, lhs, rhs)
    monkeypatch.setattr(cases, "PLAIN_GROUPED_MAX", 0)
    monkeypatch.setattr(cases, "GROUP_ROWS", 8)  # several tiles per group, the last ones partial
    by_group = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)), static_argnums=0)(case.reference, lhs, rhs)
    for got, want in zip(jax.tree.leaves(by_group), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_float8_cache_shapes_read_half_the_bytes():
    # fp8=1: the serving cases' caches in float8_e4m3fn with the bench's scales; the bytes model counts one byte a
    # cache element, and the op still matches the reference (the peers dequantize for themselves).
    import jax.numpy as jnp

    from ejkernel.bench import cases

    for op, text in (
        ("page_attention", "N=2,H=4,K=2,D=32,L=64,P=16"),
        ("ragged_decode_attention", "B=2,H=4,K=2,D=32,L=64"),
    ):
        case = CASES[op]
        plain, fp8 = case.parse(text), case.parse(text + ",fp8=1")
        inputs = case.make(fp8, jnp.bfloat16)
        assert inputs.args[1].dtype == inputs.args[2].dtype == jnp.float8_e4m3fn
        assert inputs.kwargs == cases.FP8_SCALES
        kv = 2 * 2 * 64 * 2 * 32  # rows x (keys and values) x L x K x D
        assert case.work(plain, "fwd", jnp.bfloat16) - case.work(fp8, "fwd", jnp.bfloat16) == kv
        out, want = case.call("xla", inputs), case.reference(inputs)
        assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) < 0.05
