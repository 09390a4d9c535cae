package enforcer

// InjectPanic makes every request path of the given server panic until the returned undo runs.
func InjectPanic(server string) (undo func()) {
	h := func(s string) {
		if s == server {
			panic("injected into " + s)
		}
	}
	panicHook.Store(&h)
	return func() { panicHook.Store(nil) }
}
