"""The engine: the step loop (core), the model runner with its persistent batch, device and memory setup, the
detokenizer, the plain-data messages and the client that the API process talks to."""
