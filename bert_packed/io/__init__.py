"""Files in and out: user text files and atomic writes (``files``), YAML (``yaml_io``),
Hugging Face checkpoints (``hf_io``) and this project's checkpoints (``checkpoint``)."""
