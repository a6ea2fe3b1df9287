"""Test-suite set-up: 8 host CPU devices so multi-device sharding is exercised on any machine."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
