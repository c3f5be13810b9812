"""Tool calling in the formats models are trained on: which format a model speaks (``formats``), how tool
definitions and past calls reach a chat template that does not know them (``prompt``), and how calls are read back
out of generated text, whole or as a stream of OpenAI deltas (``parser``). No web framework here."""
