"""flux2 on the shared diffusion engine; all logic lives in engine_lib.serving.triton_model."""

from engine_lib.serving.triton_model import TritonPythonModel  # noqa: F401
