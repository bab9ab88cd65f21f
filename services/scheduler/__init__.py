"""The scheduler service: block accounting and step planning for one executor."""
