"""Runnable examples on top of the library: ``train_digits`` (DDP on sklearn's digits with the dosa
hook or dense Gloo; what the demo and ``dosa testbed run`` launch)."""
