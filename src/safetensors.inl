// safetensors: implementation.
