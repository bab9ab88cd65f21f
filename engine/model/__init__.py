"""The engine's own decoder (Llama, Mistral, Qwen2) and its safetensors loader."""
