"""Model families read from config.json, without torch (one module a family)."""
