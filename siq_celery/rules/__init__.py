"""The rules of every limit kind, and their Lua twins beside them by name."""
