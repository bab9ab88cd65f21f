"""The executor service: model, paged cache and sampling, driven by ScheduledSteps."""
