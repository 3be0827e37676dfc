"""Ray wiring, configuration, the ``kvmesh`` CLI, the client SDK and autoscaling."""
