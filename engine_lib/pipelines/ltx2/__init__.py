"""LTX-2 text to video with audio (diffusers `LTX2Pipeline`), request and step batching."""
