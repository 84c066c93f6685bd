"""Model implementations: one Llama-family decoder with config switches."""
