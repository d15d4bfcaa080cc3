"""Conformance suites: one per op, run against every installed implementation (or those selected).

Run them against your own plugin's implementations with::

    pytest --pyargs ejkernel.testing.conformance --ejkernel-platform=myplatform

(the options come from ejkernel's pytest plugin, installed with ``ejkernel-core``). Each test
compares an implementation, called through the public function with its platform forced, with
the reference in ``ejkernel.testing.reference`` on fresh random inputs. ``--ejkernel-platform``
takes a platform (all of its implementations) or one implementation's name (``triton_interpret``);
``--ejkernel-backend=cpu`` tests implementations registered for another backend than the current
device's.

Two tiers, chosen with ``--ejkernel-tier``:

- ``cpu`` (the default, what CI runs): small shapes (lengths of a few dozen, head dims of 16 to 64)
  with every option and dtype, edge cases and bad inputs; and, per suite, a call a few tiles long
  run with the launch configurations the implementation offers the autotuner
  (``test_every_candidate_config_matches_reference``), at most ``_harness.CPU_TIER_CANDIDATES``
  of them per stage.
- ``gpu``: all of the above with every candidate configuration, plus the ``test_gpu_tier_*`` tests:
  realistic shapes (lengths of 1024 and more that are a multiple of no block size, head dim 128,
  GQA, serving steps of 64 sequences of about 2000 tokens, an MoE layer's grouped matmul), in
  bfloat16 and float32, forward and gradients against the float32 reference. On the CPU tier those
  are skipped. A plugin author checks a GPU kernel with::

      pytest --pyargs ejkernel.testing.conformance --ejkernel-platform=NAME --ejkernel-tier=gpu

  (``ring_attention``'s cases need 4 devices; with fewer they are skipped.)

Launch configurations are each implementation's own params classes, built from its own
``heuristic_cfg``/``candidate_cfgs`` for the call's invocation (``_harness.check_candidate_configs``):
no suite hard-codes another implementation's parameters.
"""
