"""Flash sale: per-SKU serialized ``buy`` tasks with fenced stock writes (see ``app.py``)."""
