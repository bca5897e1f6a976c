"""One module per routing strategy; each registers itself with ``routing.registry``."""
