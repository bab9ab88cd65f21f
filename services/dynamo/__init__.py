"""kvpager as an NVIDIA Dynamo backend (`kvpager dynamo`, the `kvpager[dynamo]` extra)."""
