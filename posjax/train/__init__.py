"""The task-agnostic training loop (:mod:`posjax.train.loop`) and its parts; it imports no task."""
