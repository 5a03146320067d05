"""Engine-free harness around the core: the synthetic demo, soak and fault processes."""
