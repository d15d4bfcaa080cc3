"""The configuration chain and what it is made of: caches, device fingerprint, autotuner."""
