"""Multi-turn tool use: parsing calls (`parsers`), schemas (`schema`), tools (`registry`, built-ins in
`builtin`), runs (`runner`)."""
