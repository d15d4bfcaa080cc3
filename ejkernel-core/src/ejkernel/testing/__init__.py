"""References and conformance suites that every backend (and third-party plugins) are checked against."""
