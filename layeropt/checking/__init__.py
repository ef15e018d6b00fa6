"""What checks the loop around the engine: ``LAYEROPT_VERIFY`` (``verify.py``) and
the watchers on torch's functions that installs at the first attach (``watch.py``)."""
