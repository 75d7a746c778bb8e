"""Integrations of ReplaySSM state with model libraries (`hf`: Hugging Face transformers).
Each is imported on its own, so that replayssm itself never needs the library."""
