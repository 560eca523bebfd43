"""Adapters for checkpoint stacks built on torch (megatron-core, DeepSpeed, torchtitan): one module each,
importing its stack only when a capability is asked for, so that a venv without it gets skips naming the
missing package. Selected by name (``--impl megatron-core``), never by default; ``make stacks`` runs each
in a venv of its own and writes docs/stacks.md."""
