"""The application on top of every component: the ``dosa`` command (``cli``, which imports a
command's registration module only when that command runs), the registrations of the commands that
belong to no one component (``capture_cli``, ``demo_cli``) and the demo (``demo/``).

Nothing below imports this package (tests/unit/test_layers.py): it may import anything, because it
is where the components are put together. ``python -m dosa`` runs ``dosa/__main__.py``, which
Python requires at the package's top; it only calls :func:`dosa.app.cli.main`."""
