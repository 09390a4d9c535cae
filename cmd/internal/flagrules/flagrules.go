// Package flagrules refuses command lines that cannot work, for both binaries: a rule says why a
// parsed command line is refused, naming its flags, and Check applies a table of them, so that a
// new flag that only works beside another joins its binary's table with one rule.
package flagrules

import (
	"errors"
	"flag"
)

// Rule says why a command line is refused, or "" when it is not.
type Rule func(c Cmdline) string

// Check applies rules to a parsed flag set and returns every reason, one error each.
func Check(fs *flag.FlagSet, rules []Rule) error {
	c := Cmdline{fs: fs, set: map[string]bool{}}
	fs.Visit(func(f *flag.Flag) { c.set[f.Name] = true })
	var errs []error
	for _, rule := range rules {
		if why := rule(c); why != "" {
			errs = append(errs, errors.New(why))
		}
	}
	return errors.Join(errs...)
}

// Cmdline is a parsed command line: the flags it set, and every flag's value.
type Cmdline struct {
	fs  *flag.FlagSet
	set map[string]bool
}

// Args are the arguments left after the flags.
func (c Cmdline) Args() []string { return c.fs.Args() }

// Given tells whether the command line set the flag, even to its default.
func (c Cmdline) Given(name string) bool { return c.set[name] }

// Value is the flag's value as text, its default when not given.
func (c Cmdline) Value(name string) string { return c.fs.Lookup(name).Value.String() }

// Get is the flag's value (flag.Getter), such as a time.Duration or an int.
func (c Cmdline) Get(name string) any { return c.fs.Lookup(name).Value.(flag.Getter).Get() }

// GivenOf lists, as --name, those of the flags the command line set.
func (c Cmdline) GivenOf(names ...string) []string {
	var out []string
	for _, n := range names {
		if c.Given(n) {
			out = append(out, "--"+n)
		}
	}
	return out
}

// NonEmpty lists, as --name, those of the flags whose value is not empty.
func (c Cmdline) NonEmpty(names ...string) []string {
	var out []string
	for _, n := range names {
		if c.Value(n) != "" {
			out = append(out, "--"+n)
		}
	}
	return out
}

// NoArguments refuses arguments left after the flags, such as the "true" of --flag true, which
// a boolean flag does not take.
func NoArguments(c Cmdline) string {
	if len(c.Args()) > 0 {
		return "unexpected argument \"" + c.Args()[0] + "\": flags take their values as --name=value"
	}
	return ""
}
