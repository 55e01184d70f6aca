"""push: the model card, the release gate and the upload to the Hugging Face Hub."""
