"""Drafter files on disk: their weight files read (`weights`) and every output directory written (`writer`)."""
