"""The floor everything stands on: UserError, what a command prints, what each `auto` means on this machine,
the OmegaConf resolvers of conf/, glibc's allocator, files written whole, the one file lock and the
user cache folder."""
