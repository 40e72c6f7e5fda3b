"""Local scheduling policies, one per file, behind one Protocol and a registry."""
