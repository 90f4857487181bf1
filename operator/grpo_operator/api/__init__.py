"""GRPOJob API: pydantic models that define every field. Imports nothing of ours but itself."""
