"""Subcommands of the ``mixprec`` command; see ``mixprec.cli``."""
