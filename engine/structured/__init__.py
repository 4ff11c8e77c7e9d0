"""Structured outputs: the grammar backend seam and the engine's compile cache, matchers and bitmasks."""
