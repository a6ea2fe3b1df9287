"""Sandbox backends: the interface, the local (bubblewrap + cgroups) and docker backends."""
