package schema

import (
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/config/crd"
	"github.com/sluice-dev/sluice/internal/settings"
)

// The schema's defaults are literals in markers; the code's are constants. Each default is
// spelled in one constant, and this test holds the generated CRD and the other defaults to it.
func TestDefaultsWhenSpelledInMarkersThenTheyEqualTheConstants(t *testing.T) {
	var def apiextensionsv1.CustomResourceDefinition
	if err := yaml.Unmarshal(crd.RateLimitPolicies, &def); err != nil {
		t.Fatal(err)
	}
	storage := def.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"].Properties["storage"]
	redis := storage.Properties["redis"]
	cases := []struct {
		name string
		got  *apiextensionsv1.JSON
		want string
	}{
		{"storage.redis.timeout", redis.Properties["timeout"].Default, `"` + string(v1alpha1.DefaultRedisTimeout) + `"`},
		{"storage.redis.credentialsSecretRef.passwordKey", redis.Properties["credentialsSecretRef"].Properties["passwordKey"].Default, `"` + v1alpha1.DefaultPasswordKey + `"`},
		{"storage.managedRedis.maxMemory", storage.Properties["managedRedis"].Properties["maxMemory"].Default, `"` + v1alpha1.DefaultManagedRedisMaxMemory + `"`},
	}
	for _, c := range cases {
		if c.got == nil || string(c.got.Raw) != c.want {
			t.Errorf("%s: the CRD's default is %v, want %s", c.name, c.got, c.want)
		}
	}
	if d, err := time.ParseDuration(string(v1alpha1.DefaultRedisTimeout)); err != nil || d != settings.Defaults().RedisTimeout {
		t.Errorf("DefaultRedisTimeout %s, settings.Defaults().RedisTimeout %v: want the same", v1alpha1.DefaultRedisTimeout, settings.Defaults().RedisTimeout)
	}
}
