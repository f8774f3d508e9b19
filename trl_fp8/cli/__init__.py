"""`trl-fp8`: the command line, one module per subcommand."""
