package v1alpha1

import "time"

// Parse returns the duration as a time.Duration. The schema admits only strings that
// time.ParseDuration accepts.
func (d Duration) Parse() (time.Duration, error) { return time.ParseDuration(string(d)) }
