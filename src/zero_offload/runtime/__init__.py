"""What every step uses, below the engine: the state protocols checkpoints read (`state`), the one kind of background
thread (`host_thread`), what a step moved and where its time went (`stats`, `step_timer`), and ``torch.compile`` under
the engine (`compiling`)."""
