"""The front door's input and output path, shared by the offline LLM and the services:
prompt checks and chat templates, detokenizing, stop strings, the offline outputs.
"""
