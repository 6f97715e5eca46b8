"""sextant: compile PyTorch models to NVIDIA GPU code, with every stage visible."""
