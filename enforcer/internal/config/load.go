package config

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	utiljson "k8s.io/apimachinery/pkg/util/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/internal/schema"
	"github.com/sluice-dev/sluice/internal/policy"
)

// Load compiles the RateLimitPolicy documents of a file, exactly as users apply them with
// kubectl: the file a user writes for standalone mode, and the one the controller renders into
// the enforcer's ConfigMap, read from the mount or through the API server, all go through here.
// Each is held to what the API server would hold it to (see Validate); unknown fields are
// errors, so a typo is never silently dropped.
//
// A file made for kubectl loads as it is, and what the enforcer does not take from it is said in
// the warnings, never dropped in silence: documents of other kinds (the Service and Deployment a
// sample ships beside its policy) are skipped, and a policy's spec.storage is ignored, since an
// enforcer takes its store from flags.
func Load(data []byte) (policies []*policy.Policy, warnings []string, err error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	ids := map[string]bool{}
	for doc := 1; ; doc++ {
		raw, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 || isOnlyComments(raw) {
			continue
		}
		if kind, ok := otherKind(raw); ok {
			warnings = append(warnings, fmt.Sprintf("document %d: skipped %s: not a RateLimitPolicy", doc, kind))
			continue
		}
		p, err := decode(raw)
		if err != nil {
			return nil, nil, fmt.Errorf("document %d: %w", doc, err)
		}
		c, err := policy.Compile(p)
		if err != nil {
			return nil, nil, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, err)
		}
		if p.Spec.Storage != nil {
			warnings = append(warnings, fmt.Sprintf("policy %s/%s: spec.storage ignored: %s", p.Namespace, p.Name, storageFromFlags))
		}
		if ids[c.ID] {
			return nil, nil, fmt.Errorf("policy %s appears twice", c.ID)
		}
		ids[c.ID] = true
		policies = append(policies, c)
	}
	if len(policies) == 0 {
		return nil, nil, errors.New("no RateLimitPolicy found")
	}
	return policies, warnings, nil
}

// otherKind reports the kind and apiVersion of a document that is not of this API group's
// RateLimitPolicy kind, which Load skips. A RateLimitPolicy of another version of the group is
// not skipped but refused by decode: it is meant for the enforcer, which cannot read it.
func otherKind(raw []byte) (string, bool) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if yaml.Unmarshal(raw, &head) != nil {
		return "", false // decode names the error
	}
	group, _, _ := strings.Cut(head.APIVersion, "/")
	if !strings.Contains(head.APIVersion, "/") {
		group = "" // the core group: v1
	}
	if head.Kind == "RateLimitPolicy" && group == v1alpha1.GroupVersion.Group || head.Kind == "" && head.APIVersion == "" {
		return "", false
	}
	return fmt.Sprintf("%s %s", head.APIVersion, head.Kind), true
}

// Validate decodes one RateLimitPolicy document and judges it as the API server would on
// create, with the admission webhook served: the CRD's own schema and CEL rules (package
// schema), unknown fields refused as kubectl's strict field validation does, then the semantic
// validation the webhook and the controller share (policy.Validate). A document without a
// namespace is in "default", as kubectl would put it with no namespace configured.
func Validate(raw []byte) (*v1alpha1.RateLimitPolicy, error) {
	p, err := decode(raw)
	if err != nil {
		return nil, err
	}
	if errs := policy.Validate(p); len(errs) > 0 {
		return nil, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, errs.ToAggregate())
	}
	return p, nil
}

// decode is Validate less the semantic validation, which Load gets from policy.Compile.
func decode(raw []byte) (*v1alpha1.RateLimitPolicy, error) {
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, err
	}
	var obj map[string]any
	if err := utiljson.Unmarshal(js, &obj); err != nil { // integers as int64, as the API server reads them
		return nil, err
	}
	if obj == nil {
		return nil, errors.New("not an object")
	}
	if obj["apiVersion"] != v1alpha1.GroupVersion.String() || obj["kind"] != "RateLimitPolicy" {
		return nil, fmt.Errorf("apiVersion %v kind %v, want %s RateLimitPolicy", obj["apiVersion"], obj["kind"], v1alpha1.GroupVersion)
	}
	if meta, ok := obj["metadata"].(map[string]any); ok && meta["namespace"] == nil {
		meta["namespace"] = "default"
	}
	name := func() string {
		meta, _ := obj["metadata"].(map[string]any)
		return fmt.Sprintf("%v/%v", meta["namespace"], meta["name"])
	}()
	// As the API server with kubectl's strict field validation: unknown fields are refused when
	// the object is decoded, before any validation could report what a misspelt field left out.
	if unknown := schema.UnknownFields(obj); len(unknown) > 0 {
		quoted := make([]string, len(unknown))
		for i, f := range unknown {
			quoted[i] = fmt.Sprintf("unknown field %q", f)
		}
		return nil, fmt.Errorf("policy %s: strict decoding error: %s", name, strings.Join(quoted, ", "))
	}
	if errs := schema.Validate(context.Background(), obj); len(errs) > 0 {
		return nil, fmt.Errorf("policy %s: %w", name, errs.ToAggregate())
	}
	defaulted, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var p v1alpha1.RateLimitPolicy
	if err := yaml.UnmarshalStrict(defaulted, &p); err != nil {
		return nil, fmt.Errorf("policy %s: %w", name, err)
	}
	return &p, nil
}

// storageFromFlags says why a file may not choose the store: one enforcer has one store for all
// the policies of its file, and the controller passes it as flags too.
const storageFromFlags = "an enforcer takes its store from flags, not from the policy file: " +
	"start it with --redis-url, --redis-cluster or --redis-sentinel for Redis, or with none of them for the memory store"

func isOnlyComments(raw []byte) bool {
	for _, line := range bytes.Split(raw, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' && !bytes.Equal(line, []byte("---")) {
			return false
		}
	}
	return true
}
