"""Schedules: backend-independent composites written once in the core, in terms of block contracts.

A schedule (ring attention: ``ejkernel.schedules.ring``) decides *what* is computed where and when (which key
block visits which device, how partial results merge, which gradients travel) and calls the block ops
(``flash_attention_block`` / ``flash_attention_block_bwd``) through the core's dispatch for the work itself, so
the fastest installed block implementation runs under it (Triton on a GPU, the XLA blockwise kernel elsewhere).

Layering: a schedule is an implementation of an op (a plugin registers it, e.g. ejkernel-xla registers the
ring for ``ring_attention``) that calls the public block functions of ``ejkernel.modules``; nothing below
``ejkernel.modules`` imports it.
"""
