"""capture: replay each prompt through the target as production decoded it; store its answer and hidden states."""
