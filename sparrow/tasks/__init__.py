"""Built-in prompt sets that need no download."""
