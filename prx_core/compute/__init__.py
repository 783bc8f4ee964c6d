"""Running work: Ray task helpers, work units and checkpoints, fault points, the doctor."""
