"""Helios text to video (diffusers `HeliosPipeline`), streamed chunk by chunk."""
