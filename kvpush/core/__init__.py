"""Engine-agnostic core of kvpush: wire formats, matching, layout, transport, worker, scheduler."""
