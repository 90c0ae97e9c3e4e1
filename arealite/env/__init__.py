"""Environments with tools and state outside the model: the tool contract (:mod:`.tools`), a
search agent's corpus and BM25 index (:mod:`.search`), a customer-service store with a simulated
user (:mod:`.retail`). Pieces of the system: they import contracts only, and workflows drive them."""
