"""Real serving engines as recycle's checks and teachers, each in a virtual environment recycle manages."""
