"""The AI report pipeline of the example project."""
