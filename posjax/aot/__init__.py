"""Compiling for GPUs and TPUs on a machine that has neither: compile-only target devices
(:mod:`posjax.aot.targets`), the train step compiled for them (:mod:`posjax.aot.compile`) and what the compiler
reports about each kernel (:mod:`posjax.aot.resources`)."""
