"""Model families. :func:`flashasr.models.registry.load_model` picks the loader for a path."""
