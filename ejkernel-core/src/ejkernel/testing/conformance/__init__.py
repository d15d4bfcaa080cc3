"""Conformance suites: one per op, run against every installed implementation (or those selected).

Run them against your own plugin's implementations with::

    pytest --pyargs ejkernel.testing.conformance --ejkernel-platform=myplatform

(the options come from ejkernel's pytest plugin, installed with ``ejkernel-core``). Each test
compares an implementation, called through the public function with its platform forced, with
the reference in ``ejkernel.testing.reference`` on fresh random inputs.
"""
